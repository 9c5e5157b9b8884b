"""Horizontal federated learning: server and client parties with compressed traffic."""
