"""The exit codes of every `flashdraft` command, in one place (documented in `flashdraft --help`'s module, cli/)."""

EXIT_OK = 0  # success
EXIT_CHECK_FAILED = 1  # a check failed (doctor: fast path incomplete; eval: meaningless timings; --verify: damage)
EXIT_BAD_INPUT = 2  # bad input or usage; the message names the file, line or field
EXIT_INTERNAL = 3  # an unexpected internal error (a traceback with --debug)
EXIT_OUTPUT = 4  # the output cannot be written: another run holds it, or the disk, a quota or a file-size limit is full
EXIT_RANK_LOST = 5  # a rank of a multi-process job died or stopped answering; the message names it
EXIT_INTERRUPTED = 130  # Ctrl-C, as the shell reports SIGINT
