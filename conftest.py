"""Settings for every test run from this repository: weight placement never depends on this
machine's timing. `ggx compile` (at set-up) keeps a measured profile in ggx's cache folder, and
loads would otherwise follow it; tests of measured placement inject a made-up profile instead
(`load_model(..., tune_profile=...)`, tests/test_placement_choice.py)."""
import os

os.environ.setdefault("GGX_TUNE_PROFILE", "off")
