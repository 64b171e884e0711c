"""Several hosts: the coordinator's service functions and the agent."""
