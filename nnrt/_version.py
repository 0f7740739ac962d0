"""The version of nnrt, in a module of its own so drivers can name it without importing the package facade."""
__version__ = "0.1.0"
