"""The Store port and its adapters. Nothing above this package imports a database driver."""
