"""Known failures of the OpInfo differential tests: (op, "fwd"|"grad", dtype) -> reason.

Applied as strict xfails: when an op gets fixed its test turns red until its entry is deleted.
"""

XFAILS: dict[tuple[str, str, str], str] = {}
