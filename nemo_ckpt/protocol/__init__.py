"""How the driver, the coordinator and the holders talk, as typed calls and values."""
