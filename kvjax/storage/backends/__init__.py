"""Where the bytes live: the verified chunk store over tensorstore, its run-time plumbing, object
reads, S3 publish mode, maintenance, tensorstore specs and link emulation."""
