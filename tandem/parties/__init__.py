"""Parties: the roles built from the engine and the transports, and the CLI."""
