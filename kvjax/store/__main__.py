"""`python -m kvjax.store {ls,du,verify,gc} --store URL`; see `kvjax.store.cli`."""

import sys

from kvjax.store.cli import main

if __name__ == "__main__":
  sys.exit(main(sys.argv))
