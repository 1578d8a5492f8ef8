"""Native DP2 scheduler exchange (feature ``dp2-native-exchange``): see docs/dp2.md."""
