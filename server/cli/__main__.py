"""``python -m server.cli``: the ``minivllm`` command."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main())
