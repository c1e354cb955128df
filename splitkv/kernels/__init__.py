"""The Triton kernels, and nothing else: each host module beside this package checks its inputs and launches.

* :mod:`splitkv.kernels.common` -- the score tile, soft cap, normalisation and slicing the kernels share;
* :mod:`splitkv.kernels.verify` -- the split-KV verify kernel (slices, partials and the in-grid merge);
* :mod:`splitkv.kernels.merge` -- the merge of a tile's slices in a second launch, and of attention states;
* :mod:`splitkv.kernels.extend` -- the extend (prefill) baseline.
"""
