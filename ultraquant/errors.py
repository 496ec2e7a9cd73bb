"""The one exception type UltraQuant raises for bad input."""


class UltraQuantError(ValueError):
    """Bad input to an UltraQuant op: names the argument and what was expected."""
