"""relay: an endpoint you own for running declared jobs in short-lived sandboxes."""

__version__ = "0.1.0"
