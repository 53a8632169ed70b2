"""The float format's entry (``gdn_export.weights.formats``): no options, every back-end and runtime."""

from gdn_export.weights.formats import WeightFormat

FORMAT = WeightFormat(name=None, help="every weight in --dtype (the default)", reference="")
