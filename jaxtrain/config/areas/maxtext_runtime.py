"""(being written)"""
KNOBS = []
