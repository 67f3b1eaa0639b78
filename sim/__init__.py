"""Simulator of synchronous data-parallel training and projection of measured runs."""
