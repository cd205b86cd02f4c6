"""Worker: agent, task runner processes, device detection and scoring."""
