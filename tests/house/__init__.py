"""Checks of the house itself: sizes, imports, the docs against the code, the test layout
and its scheduling under xdist."""
