// Package node holds no code: the scenarios are in its tests, which drive a single-node
// Kubernetes brought up by package cluster.
package node
