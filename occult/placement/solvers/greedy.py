"""The paper's greedy placement: clustering on the pairwise co-activation matrix.

Device 0 is seeded with the most co-activated pair, a device grows with the unplaced expert of
highest mean co-activation with its members, and the next device is seeded with the unplaced
expert least co-activated with all experts placed so far.
"""

from __future__ import annotations

import numpy as np

from occult.placement.layout import check_divisible


def greedy_layer(coact_EE: np.ndarray, num_devices: int) -> np.ndarray:
    """[E] expert -> device by the paper's greedy co-activation clustering (ties: lowest id)."""
    C = np.asarray(coact_EE, dtype=np.float64)
    E = C.shape[0]
    per = check_divisible(E, num_devices)
    load = np.diag(C).copy()
    C = C.copy()
    np.fill_diagonal(C, 0.0)
    dev = np.full(E, -1, dtype=np.intp)
    for d in range(num_devices):
        free = dev < 0
        if d == 0 and per >= 2:
            pair = np.where(free[:, None] & free[None, :] & ~np.eye(E, dtype=bool), C, -np.inf)
            a, b = np.unravel_index(np.argmax(pair), pair.shape)
            members = [int(a), int(b)]
        elif d == 0:
            members = [int(np.argmax(load))]
        else:
            placed = ~free
            score = np.where(free, C[:, placed].sum(1), np.inf)
            members = [int(np.argmin(score))]
        dev[members] = d
        while len(members) < per:
            free = dev < 0
            score = np.where(free, C[:, members].mean(1), -np.inf)
            e = int(np.argmax(score))
            members.append(e)
            dev[e] = d
    return dev
