"""What the state is: where every element lives, in which format, within which RAM budget.

Pure descriptions computed from the parameters and the arguments (no I/O), and torch's
state-dict format they convert to. Internal.
"""
