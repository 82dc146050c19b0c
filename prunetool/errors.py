"""One exception family; the CLI turns each into a single line on stderr and exit code 1."""


class PrunetoolError(Exception):
    """A problem the user can act on. The message is shown as one line, so make it say what to do."""


class ModelSourceError(PrunetoolError):
    """MODEL could not be found, fetched, converted or read."""


class UnsupportedModelError(PrunetoolError):
    """The checkpoint is readable but is not a decoder architecture prunetool can score."""


class CalibrationError(PrunetoolError):
    """The calibration source is missing, empty, binary or too short for the requested windows."""


class OptionError(PrunetoolError):
    """An option value is out of range or inconsistent with another."""


class VerificationError(PrunetoolError):
    """A written checkpoint failed its check (reload, layer count, cached generation, perplexity)."""


class MissingExtraError(PrunetoolError):
    """A feature needs an optional dependency that is not installed; the message names the pip extra."""


class TrainingError(PrunetoolError):
    """Training (heal) cannot go on: a non-finite loss, or a checkpoint that does not belong to this run."""
