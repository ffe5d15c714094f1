"""``python -m AutoXLA.cli``: the `autoxla` command without installing the package."""
import sys

from .main import main

sys.exit(main())
