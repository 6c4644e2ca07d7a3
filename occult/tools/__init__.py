"""Command-line tools built on the library: `demo` (`occult demo`, the side-by-side main job) and
`bench` (`occult bench`, one layer timed on 1-N GPUs against measured ceilings; its table and
summary in `bench_report`). Each has
`main(args)`; `occult.cli.tools` declares them as commands, with their flags.
"""
