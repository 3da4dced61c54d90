"""Errors raised by oomless. Every one says what was wrong and what would work."""

import copy


class OomlessError(Exception):
    """Base class of every error oomless raises on purpose."""


class SizeError(OomlessError, ValueError):
    """A memory size that does not parse, or is not positive."""


class PlanError(OomlessError):
    """No plan fits the memory budget.

    ``minimum_bytes`` is the smallest budget that would fit and ``limiting_block`` the block
    whose footprint forces it (None when static bytes alone exceed the budget). ``floor_block`` is
    the block that sets ``minimum_bytes`` (given even when static bytes alone exceed the budget).
    `PlanError.deferred` makes one whose message, ``minimum_bytes`` and ``floor_block`` are worked out
    when first read.
    """

    def __init__(self, message: str, minimum_bytes: int | None = None, limiting_block: str | None = None,
                 floor_block: str | None = None):
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.limiting_block = limiting_block
        self.floor_block = floor_block if floor_block is not None else limiting_block
        # The profile the refused plans were made from, where it is not the one `plan` measured first
        # (a step measured with chains split, `plan.splitting`): what it plans from when given back.
        self.profile = None
        # Which chains a refusal's step had in slabs and the smallest budget without them, where
        # splitting lowered it (its message ends with it).
        self.split_note: str | None = None

    @classmethod
    def deferred(cls, named, limiting_block: str | None = None) -> "PlanError":
        """A refusal whose (message, minimum_bytes, floor_block) ``named()`` returns, called when any
        of them is first read. Naming the smallest budget takes a search of its own (the planner's),
        and a planning call refuses many candidates (static placements, coarser granularities) of
        which it reads the numbers of one."""
        error = cls("", limiting_block=limiting_block)
        del error.minimum_bytes, error.floor_block      # read through __getattr__ until named
        error._named = named
        return error

    def _name(self) -> None:
        named = self.__dict__.pop("_named", None)
        if named is not None:
            message, self.minimum_bytes, self.floor_block = named()
            self.args = (message,)

    def __getattr__(self, name: str):
        # Only attributes not set: a deferred refusal's numbers before they are named.
        if name in ("minimum_bytes", "floor_block") and "_named" in self.__dict__:
            self._name()
            return getattr(self, name)
        raise AttributeError(name)

    def __str__(self) -> str:
        self._name()
        return super().__str__()

    def __repr__(self) -> str:
        self._name()
        return super().__repr__()

    def __reduce__(self):
        self._name()        # a closure does not pickle: its numbers do
        return super().__reduce__()

    def note_split(self, note: str) -> None:
        """Keep ``note`` (which chains this refusal's step had in slabs, and the smallest budget
        without them) as `split_note`, and end the message with it."""
        self._name()
        self.split_note = note
        self.args = (f"{self.args[0]} ({note})",)

    def kept(self) -> "PlanError":
        """This refusal as a value to keep (a candidate's result, the floor a search probes): without
        its traceback, whose frames hold their locals (a caller's batch among them) in a cycle with
        any frame that keeps the error, which only the garbage collector breaks."""
        return self.with_traceback(None)

    def to_raise(self) -> "PlanError":
        """A copy of a kept refusal to raise: raising the kept one would give it a traceback through
        the frames that keep it, the cycle `kept` avoids."""
        return copy.copy(self)      # the message and attributes; an exception's copy has no traceback


class ApplyError(OomlessError):
    """A plan cannot be installed on this model (already installed, blocks missing, ...)."""


class InputError(OomlessError, ValueError):
    """Example inputs or model outputs that oomless cannot work with as given."""


class CollectiveError(OomlessError, RuntimeError):
    """A torch.distributed collective failed or timed out; the message names the rank and the collective."""


class CheckpointError(InputError):
    """A checkpoint that cannot be resumed: damaged (checksum or format), from other settings, or of
    other shapes than the model. ``path`` is the file (or the directory, when none is intact)."""

    def __init__(self, message: str, path=None):
        super().__init__(message)
        self.path = path


def one_line(error: BaseException, limit: int = 300) -> str:
    """The first line of ``error``'s message, at most ``limit`` characters: for quoting a library's
    error inside one of ours without a screenful of text."""
    text = str(error).strip()
    text = text.splitlines()[0] if text else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
