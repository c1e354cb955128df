"""``python -m splitkv.bench``: see :mod:`splitkv.bench.run`."""

from .run import main

if __name__ == "__main__":
    raise SystemExit(main())
