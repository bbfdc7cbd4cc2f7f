package config

// Plan is what applying a new configuration over an old one means, by driver name.
// Every slice is in the order of the file it comes from.
type Plan struct {
	// Added are drivers only in the new configuration.
	Added []Driver
	// Removed are drivers only in the old configuration, as they were configured there.
	Removed []Driver
	// Changed are drivers in both whose Registration differs, as configured now: they are
	// registered anew.
	Changed []Driver
	// Updated are drivers in both whose Registration is the same and whose other fields
	// (Local, Policy, Display) differ, as configured now: their running loop takes them, and
	// kubelet sees nothing.
	Updated []Driver
}

// Empty reports whether the plan changes nothing.
func (p Plan) Empty() bool {
	return len(p.Added) == 0 && len(p.Removed) == 0 && len(p.Changed) == 0 && len(p.Updated) == 0
}

// Diff compares two resolved configurations by driver name. A nil old configuration means
// nothing runs yet; a nil new one means nothing should. Because drivers are compared after
// defaults are folded in, a change of registrationDir marks every driver as changed, a change
// of defaults marks every driver that inherits it as updated (defaults set only Policy),
// and an edit of comments or key order changes nothing.
func Diff(old, new *RegistrarConfig) Plan {
	var p Plan
	before := map[string]Driver{}
	if old != nil {
		for _, d := range old.Drivers {
			before[d.Name] = d
		}
	}
	now := map[string]bool{}
	if new != nil {
		for _, d := range new.Drivers {
			now[d.Name] = true
			prev, ok := before[d.Name]
			switch {
			case !ok:
				p.Added = append(p.Added, d)
			case !prev.Registration.Equal(d.Registration):
				p.Changed = append(p.Changed, d)
			case !prev.Equal(d):
				p.Updated = append(p.Updated, d)
			}
		}
	}
	if old != nil {
		for _, d := range old.Drivers {
			if !now[d.Name] {
				p.Removed = append(p.Removed, d)
			}
		}
	}
	return p
}
