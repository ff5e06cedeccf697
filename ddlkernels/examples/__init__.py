"""Runnable examples: ``python -m ddlkernels.examples.train --help`` (needs ``pip install ddlkernels[torch]``)."""

__all__: list = []
