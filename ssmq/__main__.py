"""``python -m ssmq`` (and ``torchrun ... -m ssmq ... --tp N``): the ssmq command."""

import sys

from ssmq.cli import main

sys.exit(main())
