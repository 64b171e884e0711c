"""Launchers: how an attempt's process is started, watched and stopped."""
