"""Benchmarks and tuning tools (GPU): none of it is on the production path.

* ``python -m splitkv.bench`` -- the verify benchmark against peers and floors (:mod:`splitkv.bench.run`;
  ``--small``: splitkv against its floors on small rows, in about a minute);
* ``python -m splitkv.bench.breadth`` -- paged pools and score features;
* ``python -m splitkv.bench.host`` -- host time per call of each entry;
* ``python -m splitkv.bench.parallel`` -- context parallelism over GPUs;
* ``python -m splitkv.bench.ladder`` -- the small-batch latency ladder (gather, dots, softmax, partials, merge);
* ``python -m splitkv.bench.mla`` -- MLA (DeepSeek-style) verify rows;
* ``python -m splitkv.bench.gluon_mla`` -- the Gluon MLA kernel for sm_90 against the ``tl`` one (go / no-go);
* ``python -m splitkv.bench.tune`` -- the tile sweep behind the tuned tables;
* ``python -m splitkv.bench.record_resources`` -- the shared-memory table behind :mod:`splitkv.resources`.

What the benchmarks share: :mod:`~splitkv.bench.timing` (the :class:`~splitkv.bench.timing.Timer`,
the read bandwidth, GPU tags), :mod:`~splitkv.bench.peers` (the implementations compared),
:mod:`~splitkv.bench.floors` (the gather floor), :mod:`~splitkv.bench.report` (tables) and
:mod:`~splitkv.bench.plots` (figures).
"""
