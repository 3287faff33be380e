"""Benchmarks of the live engine that ship with the package (``pagedkv bench ...``).

Each one measures its baseline and pagedkv in the same process, on the same model and inputs,
and prints the ratio: a figure is only meaningful next to the thing it is compared with.
"""

#: Where benchmark plots go unless ``--out`` says otherwise (``pagedkv demo`` writes there too).
DEFAULT_OUT = "pagedkv-report"
#: Length mixes of the sharing benchmark's samples-and-beams experiment.
MIXES = ("alpaca", "sharegpt")
FORK_KINDS = ("parallel", "beam")
