"""Install, demo, benchmark and study scripts; run them as modules from the repository root
(``python -m scripts.demo.train --help``). See scripts/README.md."""
