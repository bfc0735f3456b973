"""``python -m llmrpc.cli``: the ``llmrpc`` command."""

import sys

from llmrpc.cli import main

sys.exit(main())
