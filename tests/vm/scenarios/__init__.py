"""One module per scenario group; each scenario is a function registered with @scenario."""
