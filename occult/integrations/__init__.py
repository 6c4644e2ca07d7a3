"""Integrations of occult with other libraries.

`occult.integrations.hf`: Hugging Face transformers MoE models (OLMoE, Qwen2-MoE, Qwen3-MoE,
Mixtral, DeepSeek-V3) profiled, placed and run expert-parallel on `OccultMoE`. Import it
explicitly; nothing here imports transformers at package import time.
"""
