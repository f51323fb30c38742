"""Reports: rich tables now; plots and the HTML report build on the same plain data."""
