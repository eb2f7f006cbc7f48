"""Parallel state kept apart from the models: process groups and the collectives models call on them."""
