"""DLRM training on Criteo click logs."""

from dlrm import ctrl_c

ctrl_c.while_importing()  # first: a command's imports take seconds (torch, triton)

__version__ = "0.1.0"
