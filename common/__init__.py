"""What training and serving share, below both: tokenizers and the one chat template
(common/tokenizer.py), datasets (common/data.py, common/geo_data.py) and DAPO's math scoring
(common/scoring.py). Imports model/ at most; rollout/ and rl/ import from here (tests/test_layering.py).
"""
