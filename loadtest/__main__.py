"""`python -m loadtest URL ...`: the same command as `kvserve loadtest`, for use without the kvserve CLI."""
import sys

from loadtest.cli import main

sys.exit(main())
