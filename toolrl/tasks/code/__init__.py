"""Code-generation tasks: loaders (HumanEval, MBPP, APPS), the test harness and its judge, the
family and its teacher (task), and the CLI that collects teacher traces (traces)."""
