"""Preference data: sources, validation, the built-in synthetic task and its gold reward."""
