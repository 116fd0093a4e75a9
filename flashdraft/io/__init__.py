"""Output storage that a run can trust: one writer per output directory (lock.py), and writes that run out of room
reported with the path and the space needed (space.py)."""


class OutputError(RuntimeError):
    """The output cannot be written: another run holds it, or the device, a quota or a file-size limit is full.

    Not a bug and not bad input: the message names the path, the holder or the space needed, and what to do.
    """
