"""Calibration: measure steps (``bench``, torch), import published profiles (``llmservingsim``),
fit the step-time model of ``kvsim.cost.fitted`` (``fit``, scipy). Imported only by
``kvsim calibrate``; torch is imported inside ``bench`` alone (``pip install .[calibrate]``).
"""
