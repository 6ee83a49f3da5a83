"""attnc.bench: the GPU benchmark harness behind ``attnc bench`` (harness.py; append.py,
backward.py) and study scripts.  It ships in the wheel, without results/ (the recorded rows);
its modules import each other relatively, and nothing in attnc.compiler imports them but the
``attnc bench`` command when it runs."""
