"""Data readers for the models paramserver is built for."""
