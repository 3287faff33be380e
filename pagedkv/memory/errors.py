"""Errors of the memory layer, precise enough to act on."""


class PoolExhaustedError(MemoryError):
    """The pool cannot supply the blocks asked for. Raised before anything changes."""

    def __init__(self, needed: int, free: int, total: int) -> None:
        self.needed, self.free, self.total = needed, free, total
        super().__init__(
            f"KV block pool exhausted: {needed} block(s) needed, {free} free of {total} in total"
        )
