"""`python -m evaluation.serving CHECKPOINT [flags]`: what `grpoflow serve-model` runs, and `eval --serve`'s
child."""

import sys

from evaluation.serving.launcher import main

sys.exit(main())
