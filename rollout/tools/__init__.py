"""Tools and environments for multi-turn rollouts: the registry (registry.py), the calculator and the
sandboxed `python` tool (calculator.py, sandbox.py) and ToolEnv (env.py). Model output is data in
this process: it is parsed, never eval'd; code runs only in sandbox.py's child processes."""
