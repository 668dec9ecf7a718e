"""``python -m mmaccel``: the same as the ``mmaccel`` command."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
