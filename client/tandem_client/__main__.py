"""Entry point for `python -m tandem_client`."""
import sys

from tandem_client.cli import main

sys.exit(main())
