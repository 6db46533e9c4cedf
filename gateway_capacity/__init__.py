"""The ``gateway-capacity`` command line: a thin shell over the packages."""
