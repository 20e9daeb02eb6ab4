"""Tools a model may call during multi-turn rollouts: the registry (registry.py) and built-ins
(calculator.py). Model output is only ever data here: nothing is eval'd or run in this process."""
