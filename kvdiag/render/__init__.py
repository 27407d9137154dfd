"""What every check's view is drawn with: terminal cells and tables (rich), SVG charts for report.html, and the
compaction of long tables. Below the checks, so that each check folder draws its own tables and plots; above
nothing but the foundation."""
